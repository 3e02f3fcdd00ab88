"""The models' side: the transformers compatibility layer, the built-in pretrained model and real-model loading."""

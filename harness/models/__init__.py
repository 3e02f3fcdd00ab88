"""The models' side: the transformers compatibility layer, the built-in pretrained model and real-model loading."""

from specaudit._moved import forward as _forward

# Before 97aaf06 `specaudit.models` was the module of built-in names, now specaudit.contracts.builtins;
# its public names still resolve here, with a DeprecationWarning (specaudit._moved).
__getattr__ = _forward(__name__)

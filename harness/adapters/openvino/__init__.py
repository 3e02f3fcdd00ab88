"""OpenVINO GenAI's `ContinuousBatchingPipeline` as a subject, audited at the output level.

The engine owns its models (OpenVINO IR exported offline from the built-in tiny Llama and its
layer-0 draft), so it is a black box: Hypothesis draws workloads (arrivals, cancels, chunked
prefill, prefix caching, a draft model or prompt lookup, K from 1 to 7, EOS, mixed limits),
each is run through the step API (`engine.OpenVinoEngine`) and every request is judged against
the batch-size-1 greedy oracle by `adapters.engine_blackbox.judge_answers`, the judge vLLM's
black box uses. A failure is shrunk by Hypothesis to a minimal workload. Per-step emissions give
acceptance and the share of ragged steps.

Nothing here imports `openvino_genai` at import time: it lives in its own venv
(`make audit-openvino`), and the main venv's tests skip without it.
"""

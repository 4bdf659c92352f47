"""Drafter training: draft vocabulary, the EAGLE-3 drafter, training-time test, export for SGLang and vLLM
(the evaluation is eagle3.evaluate)."""

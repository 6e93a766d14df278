"""The engine's logits on a fixed probe, the moment the engine is ready: built, and in a resumed run loaded from its
checkpoint. Rank 0 writes them to RUN_DIR/probe_logits.pt (the probe ids and the logits as the engine computed
them), so an exported model can be checked against the engine that trained it (labs.export, chapter 5).

The probe is the corpus's first `PROBE_TOKENS` tokens, one sequence, the same on every rank: under ZeRO-3 every
rank must run the forward (each gathers the parameters it lacks from the others). No dropout runs (eval mode), and
the model goes back to training mode afterwards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labs import data
from labs.train import Instrument

PROBE_TOKENS = 32
FILE = "probe_logits.pt"


class ProbeLogits(Instrument):
    name = "probe_logits"

    def after_engine(self, engine):
        spec = self.spec
        ids = data.corpus_tokens(spec["data"])[:PROBE_TOKENS].view(1, -1).to(engine.device)
        hf = engine.module.hf
        hf.eval()
        with torch.no_grad():
            logits = hf(input_ids=ids).logits
        hf.train()
        if dist.get_rank() == 0 and self.run_dir is not None:
            torch.save({"ids": ids.cpu(), "logits": logits.cpu()}, self.run_dir / FILE)

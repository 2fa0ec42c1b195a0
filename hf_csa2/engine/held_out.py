"""Keep-the-best-state rule shared by the gradient refinements.

Each refinement trains on some calibration windows and scores the model on windows it never
trains on; the state with the lowest held-out score (the starting state included) is the
one kept, so a refinement can never make the model worse on unseen text than its closed-form
or converted start.
"""

from __future__ import annotations

import torch


class BestState:
    """Snapshot of ``parameters`` at the best held-out score seen so far.

    ``BestState(params, start_score)`` records the starting state as step 0; ``offer(score,
    step)`` snapshots when the score improves; ``restore()`` copies the kept state back.
    """

    def __init__(self, parameters: list[torch.nn.Parameter], start_score: float):
        self.parameters = list(parameters)
        self.start = self.best = float(start_score)
        self.step = 0
        self._state = [p.detach().clone() for p in self.parameters]

    def offer(self, score: float, step: int) -> bool:
        if score < self.best:
            self.best, self.step = float(score), step
            self._state = [p.detach().clone() for p in self.parameters]
            return True
        return False

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in zip(self.parameters, self._state):
            p.copy_(saved)
            p.grad = None


__all__ = ["BestState"]

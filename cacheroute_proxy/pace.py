"""How fast something really is against its prediction: an instance, learned from its first
tokens (the sidecar's timelines), or a KDN (Knowledge Delivery Network: the knowledge server) ->
instance link, learned from its KV transfers (each worker's link timelines).

Workers predict service, decode and transfer times from one predictor profile and a link's
nominal bandwidth, so an instance that is three times slower than the profile (an older GPU, a
larger model, a noisy neighbour) looks as cheap as the others and keeps receiving its count
share of a burst. Each observation says how far off the prediction was: the pace is a factor on
the predicted durations, moved a step toward observed/predicted in log space (so 3x too slow and
3x too fast pull equally hard), clamped so one wild sample cannot flip the ranking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Below this a prediction is mostly clock jitter and event latency: learning from it is noise.
MIN_PREDICTED_S = 0.005
RATIO_LIMITS = (0.1, 10.0)   # one observation moves the pace by at most this ratio^step
FACTOR_LIMITS = (0.05, 50.0)


@dataclass
class Pace:
    step: float              # 0 = never learn (the profile is trusted as is), 1 = last sample wins
    factor: float = 1.0      # observed / predicted durations on this instance
    observations: int = 0

    def observe(self, predicted_s: float, observed_s: float) -> None:
        # Called for every first token: the clamps are comparisons, not min/max calls (the
        # same floats).
        if self.step <= 0.0 or predicted_s < MIN_PREDICTED_S:
            return
        ratio = observed_s / predicted_s if observed_s > 0.0 else 0.0
        low, high = RATIO_LIMITS
        if ratio < low:
            ratio = low
        elif ratio > high:
            ratio = high
        learned = self.factor * math.exp(self.step * math.log(ratio))
        low, high = FACTOR_LIMITS
        self.factor = low if learned < low else high if learned > high else learned
        self.observations += 1

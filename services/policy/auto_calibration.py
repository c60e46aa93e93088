"""Online calibration of the `auto` policy's TTFT predictions against the TTFTs the router measures (pure).

The profile (`kvpath profile`) prices the model's work on an idle machine; a live request also pays what the
model leaves out (dispatch, the bus, first-token delivery) and runs at whatever speed the machine has now (two
engines sharing two cores, neighbours). The router therefore fits measured ~ overhead_s + scale x predicted
over its last `window` requests, weighting each by 1 / measured^2 so that the fit minimises relative error
(the error `kvpath bench auto` reports); until `min_points` requests have been measured, only the
overhead moves (the mean residual). The result goes into `AutoProfiles.overhead_s` and `time_scale`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_SCALE, MAX_SCALE = 0.25, 4.0


@dataclass(slots=True)
class TtftCalibration:
    window: int = 64
    min_points: int = 8
    overhead_s: float = 0.0
    scale: float = 1.0
    points: deque[tuple[float, float]] = field(default_factory=deque)  # (raw prediction, measured) seconds

    def predict(self, raw_s: float) -> float:
        return self.overhead_s + self.scale * raw_s

    def observe(self, raw_s: float, measured_s: float) -> None:
        """One request's raw (uncalibrated) prediction and its measured TTFT."""
        if measured_s <= 0 or raw_s < 0:
            return
        self.points.append((raw_s, measured_s))
        while len(self.points) > self.window:
            self.points.popleft()
        if len(self.points) < self.min_points:
            self.overhead_s = max(0.0, sum(m - self.scale * p for p, m in self.points) / len(self.points))
            return
        self._fit()

    def _fit(self) -> None:
        """Weighted least squares of measured = a + s x raw, weights 1 / measured^2; s clamped, a >= 0."""
        w = [1.0 / (m * m) for _, m in self.points]
        sw = sum(w)
        mean_p = sum(wi * p for wi, (p, _) in zip(w, self.points, strict=True)) / sw
        mean_m = sum(wi * m for wi, (_, m) in zip(w, self.points, strict=True)) / sw
        var_p = sum(wi * (p - mean_p) ** 2 for wi, (p, _) in zip(w, self.points, strict=True))
        cov = sum(wi * (p - mean_p) * (m - mean_m) for wi, (p, m) in zip(w, self.points, strict=True))
        scale = cov / var_p if var_p > 0 else self.scale
        self.scale = min(MAX_SCALE, max(MIN_SCALE, scale))
        self.overhead_s = max(0.0, mean_m - self.scale * mean_p)

"""Online calibration of the `auto` policy's TTFT predictions against the TTFTs the router measures (pure).

The profile (`kvpath profile`) prices the model's work on an idle machine; a live request also pays what the
model leaves out (dispatch, the bus, first-token delivery) and runs at whatever speed the machine has now (two
engines sharing two cores, neighbours). The router therefore fits measured ~ overhead_s + scale x predicted
over its last `window` requests, weighting each by 1 / measured^2 so that the fit minimises relative error
(the error `kvpath bench auto` reports); until `min_points` requests have been measured, only the
overhead moves (the mean residual). The result goes into `AutoProfiles.overhead_s` and `time_scale`.

One overhead and one slowdown fit every path alike. A path the profile prices wrong in a way of its own (on
prefill/decode engines sharing two cores, `remote/hbm` measured ~1.6x its calibrated price and `local/hbm`
~0.85x) keeps that bias, and auto then picks it too often or too rarely. `PathCorrection` learns, per path
(a plan's label), the median ratio of measured to calibrated TTFT, and applies it only where it stands out of
the path's own spread (median x sqrt(n) > z x the robust deviation): on paths whose error is noise around the
calibrated price (one engine's batch mates, the neighbours) it stays 1, which a correction would only
chase. The result goes into `AutoProfiles.path_scale`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_SCALE, MAX_SCALE = 0.25, 4.0
MIN_SPREAD = 0.02  # of log(measured / predicted): ratios that agree within ~2% still need a clear median


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


@dataclass(slots=True)
class PathCorrection:
    window: int = 32  # ratios kept per path
    min_points: int = 4
    z: float = 4.0  # how clearly the median must stand out of the spread (a z-score of the median)
    log_ratios: dict[str, deque[float]] = field(default_factory=dict)  # path -> log(measured / predicted)
    factors: dict[str, float] = field(default_factory=dict)  # paths with a correction -> its factor

    def factor(self, path: str) -> float:
        return self.factors.get(path, 1.0)

    def observe(self, path: str, predicted_s: float, measured_s: float) -> None:
        """One request of `path`: its calibrated prediction before this correction, and its measured TTFT."""
        if predicted_s <= 0 or measured_s <= 0:
            return
        logs = self.log_ratios.setdefault(path, deque(maxlen=self.window))
        logs.append(math.log(measured_s / predicted_s))
        self.factors.pop(path, None)
        if len(logs) < self.min_points:
            return
        center = statistics.median(logs)
        spread = max(MIN_SPREAD, 1.4826 * statistics.median([abs(x - center) for x in logs]))
        if abs(center) * math.sqrt(len(logs)) > self.z * spread:
            self.factors[path] = min(MAX_SCALE, max(MIN_SCALE, math.exp(center)))

"""Engine service: one model replica (colocated, prefill or decode role) on one device."""

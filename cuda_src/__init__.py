"""Hand-written CUDA device headers (NVRTC-safe), shipped as package data."""

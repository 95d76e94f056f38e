"""fusedmoe's Triton backend: kernels.py (jitted), experts.py (host), tiles.py (configs)."""

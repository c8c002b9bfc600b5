"""What runs inside Triton's process, not ours: our Python-based backends (`backends/`, each
installed into Triton's backend directory by the launcher, embeddings/tooling/triton_server.py) and
the templates of every exported model's Triton configurations (`model_configs/`, rendered by
embeddings/tooling/model_configs.py).

The backends import nothing of the project: Triton's Python stubs load them by path, with no
Django and no `embeddings` package set up (tests/test_layering.py holds them to it).
"""

from pathlib import Path

IN_TRITON_DIR = Path(__file__).resolve().parent
BACKENDS_DIR = IN_TRITON_DIR / "backends"

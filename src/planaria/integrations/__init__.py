"""Adapters from the training code users already have to planaria jobs.

Each adapter is importable only where its library is installed (an ``ImportError`` naming
the extra otherwise): ``planaria.integrations.transformers`` (``pip install
"planaria[hf]"``), ``planaria.integrations.lightning`` (``pip install
"planaria[lightning]"``), ``planaria.integrations.torchtitan`` (``pip install
"planaria[torchtitan]"``, and ``triton`` beside a CPU-only torch); ``import planaria``
imports none of them.
"""

__all__: list[str] = []

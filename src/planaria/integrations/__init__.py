"""Adapters from the training code users already have to planaria jobs.

Each adapter is a subpackage importable only when its framework is installed (an
``ImportError`` naming the extra to install otherwise); ``import planaria`` imports none of
them.
"""

__all__: list[str] = []

"""Adapters from the training code users already have to planaria jobs.

Each adapter is a module of its own, importable only where its library is installed
(``planaria.integrations.lightning`` needs ``pip install "planaria[lightning]"``);
``import planaria`` imports none of them.
"""

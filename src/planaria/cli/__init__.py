"""The ``planaria`` command and the spec files it runs."""

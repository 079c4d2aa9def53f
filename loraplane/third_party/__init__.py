"""Code generated from vendored third-party protos (see ``scripts/gen_protos.py``)."""

"""opd_common: the record contract shared by the opd tools (schema, streams, manifests, tiny models)."""

__version__ = "0.1.0"

"""Domain errors. Library code raises these; each CLI turns them into one clear error line."""


class OpdError(Exception):
    """Base class: a user-facing problem whose message says what is wrong and how to fix it."""


class RecordError(OpdError):
    """A record is malformed: the message names the file, the record number and the field."""


class StreamError(OpdError):
    """An input or output stream cannot be read or written (missing file, bad manifest, hash)."""


class ConfigError(OpdError):
    """A flag or config-file value is invalid: the message names the flag."""


class DependencyError(OpdError):
    """An optional dependency is missing: the message names the extra to install."""


def require(module: str, extra: str):
    """Import `module` or raise DependencyError naming the pip extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - exercised only on broken installs
        raise DependencyError(
            f"{module} is not installed ({exc}); install it with: pip install 'opd[{extra}]'"
        ) from exc

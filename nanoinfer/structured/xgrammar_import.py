"""xgrammar, imported only when a request asks for structured outputs (an optional dependency)."""

INSTALL_HINT = "structured outputs need xgrammar: pip install nanoinfer[structured] (or pip install xgrammar)"


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return xgrammar

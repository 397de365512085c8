"""The running Python's own regex parser (``re._parser`` and ``re._constants`` from 3.11, ``sre_parse`` and
``sre_constants`` before), through which rule patterns are read: their literal prefilters
(``convert.patterns``) and whether they can see layer or expert numbers (``convert.templates``)."""

import sys

if sys.version_info >= (3, 11):
    import re._constants as constants
    import re._parser as parser
else:  # pragma: no cover - Python 3.10
    import sre_constants as constants
    import sre_parse as parser

__all__ = ["constants", "parser"]

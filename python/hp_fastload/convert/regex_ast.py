"""The running Python's own regex parser (``re._parser`` and ``re._constants``), through which rule patterns are
read: their literal prefilters (``convert.patterns``) and whether they can see layer or expert numbers
(``convert.templates``)."""

import re._constants as constants
import re._parser as parser

__all__ = ["constants", "parser"]

"""The old path of `specaudit.audits.gate`: importing it warns (see specaudit._moved)."""

from specaudit._moved import alias as _alias

__getattr__, __dir__ = _alias(__name__)

"""Bridges to other systems, each behind its optional extra (`ray`: qllama[ray])."""

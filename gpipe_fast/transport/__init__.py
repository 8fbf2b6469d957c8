"""How boundary values move between stages: the Transport protocol, in-process, on the wire."""

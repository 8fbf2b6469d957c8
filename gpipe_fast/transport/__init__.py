"""The transports, in one home: the Transport protocol, in-process, the wire, across processes."""

"""Sans-I/O protocol cores: bytes (or ZeroMQ frames) in, typed events out. No sockets, no event loop, no clock."""

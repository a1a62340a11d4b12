"""The reverse tunnel's protocol, sans-I/O: the frames both ends speak (`frames`)."""

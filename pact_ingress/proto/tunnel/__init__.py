"""The reverse tunnel's protocol, sans-I/O: the frames both ends speak (`frames`), the
numbers they agree on (`constants`) and the ingress's session logic that needs no I/O —
the token table and the pool sizer (`session`)."""

"""The reverse tunnel's two ends: `server` (the ingress side), `connector` (the home
side) and `stream_job` (one connector data connection on a thread of its own)."""

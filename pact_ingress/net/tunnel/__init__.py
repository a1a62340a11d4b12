"""The reverse tunnel's two ends and what they share: `server` (the ingress side),
`connector` (the home side), `stream_job` (one connector data connection on a thread of
its own), `transport` (raw or TLS data connections) and `common` (trio helpers both ends
use). The ends import the protocol (`proto/tunnel`) and `common`, never each other."""

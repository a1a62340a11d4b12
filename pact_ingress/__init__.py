"""pact-ingress: an edge ingress for PACT home nodes.

Routes TLS by SNI on one port; per subdomain it either passes the caller's TLS through
untouched to the home node (end-to-end mTLS), or terminates public TLS and re-originates
over mutually pinned mTLS, enforcing the node's seal posture and rate limits at the edge.
"""

__version__ = "0.1.0"

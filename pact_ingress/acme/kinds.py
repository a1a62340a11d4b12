"""The ACME challenge kinds by name: what the manager needs to tell them apart, apart
from `issuer` (which brings in the `acme` client and `requests`, needed only when an
order runs)."""

TLS_ALPN_01 = "tls-alpn-01"
HTTP_01 = "http-01"
DNS_01 = "dns-01"
ALL_CHALLENGES = (TLS_ALPN_01, HTTP_01, DNS_01)

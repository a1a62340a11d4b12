"""Certificates for terminate routes: ACME automation and the on-disk store.

- `manager.CertManager`: what the router, the :80 listener and the admin API call.
- `store.list_store(state_dir)`: offline inventory for `pact-ingress certs list`.
- `issuer`, `account`, `tlsalpn`, `dns01`: one ACME order, run in a worker thread.
- `schedule`: renewal time, backoff and issuance budgets (pure).

Nothing is re-exported here on purpose: importing `store` for an offline listing should
not pull in the `acme` client and `requests`.
"""

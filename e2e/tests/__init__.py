"""The e2e scenarios, run by `make e2e` (never by `make test`)."""

"""The router: the HTTP front of a PD deployment."""

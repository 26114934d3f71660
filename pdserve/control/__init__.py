"""The control plane: the controller and its scaling policy, role switches, rollouts (the
`pdserve rollout` client, the router's admin routes it drives, its SLO check) and the fleets that
start and stop workers (local processes, Kubernetes Deployments). It runs inside the router process,
wired in by the router's app factory (router/gateway.py), and imports no router module at run time."""

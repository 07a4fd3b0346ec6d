"""The architecture zeroqueue replaces: one long-lived model replica per slot behind Serve's queue."""

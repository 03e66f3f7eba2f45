"""The control plane: configuration, CLI, and (later) the Ray Serve application."""

"""The data plane that runs on each host: model families, the engine, and the worker classes."""

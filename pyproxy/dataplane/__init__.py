"""Dataplane backends. Each one renders the model's DesiredState with a pure `render()` and programs the
kernel in one `apply()`; the `Dataplane` protocol in `base` is what the proxier sees."""

"""Pure layer functions: `f(params, x, ...) -> y` (and state in, state out where a layer has state)."""

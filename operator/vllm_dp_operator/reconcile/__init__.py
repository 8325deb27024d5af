"""One resource's reconcile: observe its children, converge them, compute its status."""

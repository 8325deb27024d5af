"""Controller machinery: the Kubernetes seam, reflectors, cache, work queue, workers, the status
writer and Events."""

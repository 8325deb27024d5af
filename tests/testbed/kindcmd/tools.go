//go:build tools

// Package tools pins kubeadm for the kind node image (kindnode.py) to the Kubernetes release
// of the test bed: this module requires the same k8s.io/kubernetes as ../go.mod, with the
// same staging pins, and adds only what kubeadm needs, so ../go.sum (the beds' cache key)
// stays as it is.
//
//	go build -o BIN k8s.io/kubernetes/cmd/kubeadm
package tools

import (
	_ "k8s.io/kubernetes/cmd/kubeadm"
)

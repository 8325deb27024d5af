//go:build tools

// Package tools pins the Kubernetes commands the test bed builds from this module:
//
//	go build -o BIN k8s.io/kubernetes/cmd/kube-apiserver (and the others below)
//
// The control plane uses the first four; the real-node mode adds kubelet and kube-proxy, so
// every component of both modes comes from one Kubernetes release.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)

//go:build tools

// Package tools pins etcd for the kind node image's etcd image (kindnode.py): the version
// kubeadm asks for (`kubeadm config images list`), built from the Go module proxy. Debian's
// etcd (3.4) lacks the flags and the /livez and /readyz probes kubeadm's static pod uses.
// etcd's own go.mod has replace directives, so `go install` refuses it; a module that
// requires it builds it:
//
//	go build -o BIN go.etcd.io/etcd/server/v3
package tools

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
)

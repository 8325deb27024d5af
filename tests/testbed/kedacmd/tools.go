//go:build tools

// Package tools pins KEDA for the autoscaling tier (kedabed.py): its operator and its metrics
// API server, built together from this module so their shared packages compile once:
//
//	go build -o DIR/ github.com/kedacore/keda/v2/cmd/operator github.com/kedacore/keda/v2/cmd/adapter
//
// KEDA's own go.mod has a replace directive, which `go install pkg@version` refuses; this
// module repeats it (go.mod) and requires the version of versions.env's KEDA_VERSION.
package tools

import (
	_ "github.com/kedacore/keda/v2/cmd/adapter"
	_ "github.com/kedacore/keda/v2/cmd/operator"
)

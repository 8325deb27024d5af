// Command coredns is CoreDNS v1.15.0 (github.com/coredns/coredns) with only the plugins the
// real-node test bed's Corefile uses. This is CoreDNS's own documented way to choose plugins at
// build time (a main package importing coremain and the plugins); it skips the cloud DNS
// backends, whose SDKs would make the build several times longer.
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"

	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}

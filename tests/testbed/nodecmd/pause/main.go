// Command pause is the pod sandbox's first process on the real-node test bed: it sleeps until
// SIGINT or SIGTERM and reaps any child re-parented to it, as the upstream pause image does.
// Built static (CGO_ENABLED=0) and packed into a one-file image, so no registry is needed.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}

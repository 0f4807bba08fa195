module superfluid

go 1.19

// Offline, from Debian's golang-github-ugorji-go-codec-dev: the codec package
// lives in the github.com/ugorji/go module there (no go.mod of its own), so
// the whole module is replaced by that directory. No go.sum is needed for a
// directory replacement; GOPROXY=off keeps the go command from the network.
require github.com/ugorji/go v1.2.8

replace github.com/ugorji/go => /usr/share/gocode/src/github.com/ugorji/go

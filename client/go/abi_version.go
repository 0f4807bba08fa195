package superfluid

// #include "superfluid.h"
import "C"

// ABIVersion is the SF_ABI_VERSION this package was written for.
// sf_segment_check compares a segment with the header it was compiled with,
// not with this code: a build against a header of another version fails
// here instead of at a plan.
const ABIVersion = 2

func _() {
	var x [1]struct{}
	_ = x[ABIVersion-C.SF_ABI_VERSION] // written for another SF_ABI_VERSION: port it to abi/superfluid.h
}

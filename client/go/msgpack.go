package superfluid

import (
	"reflect"

	"github.com/ugorji/go/codec"
)

// The new msgpack spec (str8, bin), as Python's msgpack writes and reads
// it; strings decode as strings; keys sorted so an op's bytes are stable.
var mp = func() *codec.MsgpackHandle {
	h := &codec.MsgpackHandle{WriteExt: true}
	h.RawToString = true
	h.Canonical = true
	h.MapType = reflect.TypeOf(map[string]any(nil))
	return h
}()

func pack(v any) ([]byte, error) {
	var b []byte
	err := codec.NewEncoderBytes(&b, mp).Encode(v)
	return b, err
}

func unpack(b []byte, v any) error {
	if len(b) == 0 {
		return nil
	}
	return codec.NewDecoderBytes(b, mp).Decode(v)
}

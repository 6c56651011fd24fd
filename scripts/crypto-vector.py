#!/usr/bin/env python3
# Independent check of docs/encryption.md: rebuilds its known-answer vector from the written
# spec alone (pure-Python HKDF and HChaCha20, ChaCha20-Poly1305 from the `cryptography` package).
# Run: python3 scripts/crypto-vector.py — it must print the value the doc gives.
import struct, uuid, hmac, hashlib, base64
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

def lp(*items): return b''.join(struct.pack('>I', len(i)) + i for i in items)
def hkdf(ikm, info, n=32):
    prk = hmac.new(b'\0'*32, ikm, hashlib.sha256).digest()
    return hmac.new(prk, info + b'\x01', hashlib.sha256).digest()[:n]
def rotl(v, c): return ((v << c) & 0xffffffff) | (v >> (32 - c))
def qr(s, a, b, c, d):
    s[a]=(s[a]+s[b])&0xffffffff; s[d]^=s[a]; s[d]=rotl(s[d],16)
    s[c]=(s[c]+s[d])&0xffffffff; s[b]^=s[c]; s[b]=rotl(s[b],12)
    s[a]=(s[a]+s[b])&0xffffffff; s[d]^=s[a]; s[d]=rotl(s[d],8)
    s[c]=(s[c]+s[d])&0xffffffff; s[b]^=s[c]; s[b]=rotl(s[b],7)
def hchacha20(key, n16):
    s = [0x61707865,0x3320646e,0x79622d32,0x6b206574] + list(struct.unpack('<8I', key)) + list(struct.unpack('<4I', n16))
    for _ in range(10):
        qr(s,0,4,8,12); qr(s,1,5,9,13); qr(s,2,6,10,14); qr(s,3,7,11,15)
        qr(s,0,5,10,15); qr(s,1,6,11,12); qr(s,2,7,8,13); qr(s,3,4,9,14)
    return struct.pack('<8I', *(s[0:4] + s[12:16]))

material = bytes(range(32)); nonce = bytes(range(0x40, 0x58))
kid = b'k1f3a9c0d'; ev = uuid.UUID('0192f3a4-5b6c-7d8e-9f00-112233445566'); ptr = b'/customer/tax_id'
plain = b'"1234567890"'
fk = hkdf(material, lp(b'outboxd field key', b'v1', kid, ptr))
ad = lp(b'v1', kid, ev.bytes, ptr)
sub = hchacha20(fk, nonce[:16])
ct = ChaCha20Poly1305(sub).encrypt(b'\0\0\0\0' + nonce[16:], plain, ad)
checks = hashlib.sha256(ev.bytes).digest()[:2] + hashlib.sha256(ptr).digest()[:2]
blob = nonce + checks + bytes([len(plain)]) + ct
print('field key', fk.hex())
print('enc:v1:' + kid.decode() + ':' + base64.urlsafe_b64encode(blob).rstrip(b'=').decode())

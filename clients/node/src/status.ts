/**
 * Reading lockd's `google.rpc.ErrorInfo` out of a failed call: the `grpc-status-details-bin`
 * trailer holds a `google.rpc.Status` whose details carry it (docs/api.md, "Status codes and
 * reasons"). A status without an ErrorInfo of domain `lockd` did not come from lockd.
 */

import grpc, { type ServiceError } from '@grpc/grpc-js';
import protobuf from 'protobufjs';

export const DOMAIN = 'lockd';
const DETAILS_KEY = 'grpc-status-details-bin';
const ERROR_INFO_TYPE = 'type.googleapis.com/google.rpc.ErrorInfo';

// The three messages involved, as published in googleapis (google/rpc/status.proto,
// google/rpc/error_details.proto, google/protobuf/any.proto); only the fields read here.
const root = protobuf.Root.fromJSON({
  nested: {
    Status: {
      fields: {
        code: { type: 'int32', id: 1 },
        message: { type: 'string', id: 2 },
        details: { rule: 'repeated', type: 'Any', id: 3 },
      },
    },
    Any: {
      fields: {
        typeUrl: { type: 'string', id: 1 },
        value: { type: 'bytes', id: 2 },
      },
    },
    ErrorInfo: {
      fields: {
        reason: { type: 'string', id: 1 },
        domain: { type: 'string', id: 2 },
        // A map field: protobufjs takes `keyType` here although its IField type does not list it.
        metadata: { keyType: 'string', type: 'string', id: 3 } as protobuf.IField,
      },
    },
  },
});
const StatusType = root.lookupType('Status');
const ErrorInfoType = root.lookupType('ErrorInfo');

interface DecodedStatus {
  code: number;
  details: { typeUrl: string; value: Uint8Array }[];
}

interface DecodedErrorInfo {
  reason: string;
  domain: string;
  metadata: Record<string, string>;
}

/** What the retry loop needs to know of a failed attempt. */
export interface StatusInfo {
  code: grpc.status;
  /** The code's name, `UNAVAILABLE`... */
  codeName: string;
  message: string;
  /** Undefined: no ErrorInfo of domain `lockd` (the status did not come from lockd). */
  reason: string | undefined;
  metadata: Record<string, string>;
}

export function codeName(code: number): string {
  return (grpc.status as unknown as Record<number, string>)[code] ?? `code ${code}`;
}

/** The reason and metadata of lockd's ErrorInfo in `err`, if any. */
export function errorInfo(err: ServiceError): { reason: string; metadata: Record<string, string> } | undefined {
  const raw = err.metadata?.get(DETAILS_KEY) ?? [];
  for (const value of raw) {
    if (!(value instanceof Uint8Array)) continue;
    let st: DecodedStatus;
    try {
      st = StatusType.toObject(StatusType.decode(value), { defaults: true }) as DecodedStatus;
    } catch {
      continue; // a malformed trailer proves nothing: treated as "not from lockd"
    }
    // A details trailer that disagrees with the status is not lockd's.
    if (st.code !== err.code) continue;
    for (const detail of st.details) {
      if (detail.typeUrl !== ERROR_INFO_TYPE) continue;
      try {
        const info = ErrorInfoType.toObject(ErrorInfoType.decode(detail.value), {
          defaults: true,
        }) as DecodedErrorInfo;
        if (info.domain === DOMAIN) return { reason: info.reason, metadata: { ...info.metadata } };
      } catch {
        // as above
      }
    }
  }
  return undefined;
}

export function statusInfo(err: ServiceError): StatusInfo {
  const info = errorInfo(err);
  return {
    code: err.code,
    codeName: codeName(err.code),
    message: err.details || err.message,
    reason: info?.reason,
    metadata: info?.metadata ?? {},
  };
}
